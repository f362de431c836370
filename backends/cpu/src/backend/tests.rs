//! The CPU backend's memory side: typed uploads and read-backs through strided windows, the KV
//! pool's block copies (device to device, to host and back), memory info, and ops refusing views
//! of the wrong shape or dtype instead of touching memory outside them.

use npu_backend::{
    Backend, DType, HostSlice, HostSliceMut, KvSpec, Layout, Readback, View, ViewMut,
};

use super::*;

fn backend() -> CpuBackend {
    CpuBackend::new(CpuConfig {
        threads: 2,
        f32_reference: false,
    })
}

#[test]
fn uploads_and_read_backs_go_through_windows_and_dtypes() {
    let mut b = backend();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let mut buf = b.alloc(dtype, 12).unwrap();
        // Rows 1..3, columns 1..3 of a 3x4 matrix.
        let win = Layout::new(5, 2, 2, 4).unwrap();
        b.upload(
            HostSlice::F32(&[1.0, 2.0, 3.0, 4.0]),
            ViewMut::new(&mut buf, win).unwrap(),
        )
        .unwrap();
        let mut all = vec![9f32; 12];
        b.read_back(&mut [Readback {
            src: View::rows(&buf, 3, 4).unwrap(),
            dst: HostSliceMut::F32(&mut all),
        }])
        .unwrap();
        assert_eq!(
            all,
            [0., 0., 0., 0., 0., 1., 2., 0., 0., 3., 4., 0.],
            "{dtype:?}"
        );
        let mut part = vec![0f32; 4];
        b.read_back(&mut [Readback {
            src: View::new(&buf, win).unwrap(),
            dst: HostSliceMut::F32(&mut part),
        }])
        .unwrap();
        assert_eq!(part, [1., 2., 3., 4.]);
    }
    let mut ids = b.alloc(DType::I32, 3).unwrap();
    b.upload(
        HostSlice::I32(&[7, -1, 3]),
        ViewMut::rows(&mut ids, 3, 1).unwrap(),
    )
    .unwrap();
    let mut back = vec![0i32; 3];
    b.read_back(&mut [Readback {
        src: View::rows(&ids, 3, 1).unwrap(),
        dst: HostSliceMut::I32(&mut back),
    }])
    .unwrap();
    assert_eq!(back, [7, -1, 3]);
    // Wrong lengths and dtypes are refused.
    let mut f = b.alloc(DType::F32, 4).unwrap();
    assert!(b
        .upload(
            HostSlice::F32(&[1.0; 3]),
            ViewMut::rows(&mut f, 2, 2).unwrap()
        )
        .is_err());
    assert!(b
        .upload(
            HostSlice::I32(&[1; 4]),
            ViewMut::rows(&mut f, 2, 2).unwrap()
        )
        .is_err());
    let mut wrong = vec![0i32; 4];
    assert!(b
        .read_back(&mut [Readback {
            src: View::rows(&f, 2, 2).unwrap(),
            dst: HostSliceMut::I32(&mut wrong),
        }])
        .is_err());
}

fn spec() -> KvSpec {
    KvSpec {
        n_layers: 3,
        num_blocks: 5,
        block_size: 4,
        n_kv_heads: 2,
        head_dim: 8,
    }
}

/// Writes distinct K/V into every slot of every layer through `kv_write`.
fn fill_pool(b: &mut CpuBackend) {
    let s = spec();
    let g = npu_backend::AttnGeometry {
        n_heads: 4,
        n_kv_heads: s.n_kv_heads,
        head_dim: s.head_dim,
        rope: npu_model::Rope {
            style: npu_model::RopeStyle::Halves,
            dims: s.head_dim,
            base: 10000.0,
            freq_scale: 1.0,
            factors: None,
        },
        scale: 1.0,
        window: None,
    };
    let slots = (s.num_blocks * s.block_size) as u32;
    let w = g.kv_width();
    b.begin_step(&npu_backend::StepInputs {
        slot_mapping: (0..slots).collect(),
        tokens: vec![0; slots as usize],
        positions: (0..slots).collect(),
        ..Default::default()
    })
    .unwrap();
    for layer in 0..s.n_layers {
        let vals: Vec<f32> = (0..slots as usize * w)
            .map(|i| (i + layer * 1000) as f32 * 0.25)
            .collect();
        let mut k = b.alloc(DType::F32, vals.len()).unwrap();
        let mut v = b.alloc(DType::F32, vals.len()).unwrap();
        b.upload(
            HostSlice::F32(&vals),
            ViewMut::rows(&mut k, slots as usize, w).unwrap(),
        )
        .unwrap();
        let neg: Vec<f32> = vals.iter().map(|x| -x).collect();
        b.upload(
            HostSlice::F32(&neg),
            ViewMut::rows(&mut v, slots as usize, w).unwrap(),
        )
        .unwrap();
        b.kv_write(
            View::rows(&k, slots as usize, w).unwrap(),
            View::rows(&v, slots as usize, w).unwrap(),
            &g,
            layer,
        )
        .unwrap();
    }
}

fn blocks_on_host(b: &mut CpuBackend, ids: &[u32]) -> Vec<Vec<u8>> {
    let bb = b.kv_block_bytes();
    let mut host = vec![0u8; ids.len() * bb];
    b.kv_blocks_to_host(ids, &mut host).unwrap();
    host.chunks(bb).map(<[u8]>::to_vec).collect()
}

#[test]
fn kv_blocks_copy_whole_by_id_on_the_device_and_through_the_host() {
    let mut b = backend();
    let s = spec();
    b.init_kv(s).unwrap();
    // K and V of every layer: 2 bytes per value.
    assert_eq!(
        b.kv_block_bytes(),
        s.n_layers * 2 * s.n_kv_heads * s.head_dim * s.block_size * 2
    );
    fill_pool(&mut b);
    let before = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert!(before.windows(2).all(|w| w[0] != w[1]), "blocks differ");
    // Device to device: block 1 over block 3, then 4 over 0.
    b.kv_copy_blocks(&[(1, 3), (4, 0)]).unwrap();
    let after = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert_eq!(after[3], before[1]);
    assert_eq!(after[0], before[4]);
    assert_eq!(after[1..3], before[1..3]);
    // Host round trip into other blocks.
    let saved = blocks_on_host(&mut b, &[2, 1]);
    b.kv_blocks_from_host(&saved.concat(), &[4, 0]).unwrap();
    let now = blocks_on_host(&mut b, &[4, 0]);
    assert_eq!(now, saved);
    // Ids outside the pool and wrong host sizes are errors.
    assert!(b.kv_copy_blocks(&[(5, 0)]).is_err());
    assert!(b.kv_copy_blocks(&[(0, 5)]).is_err());
    let bb = b.kv_block_bytes();
    assert!(b.kv_blocks_to_host(&[0], &mut vec![0u8; bb - 1]).is_err());
    assert!(b.kv_blocks_from_host(&vec![0u8; bb], &[7]).is_err());
}

/// One layer of one block read as token rows gives what `kv_write` wrote there (values chosen
/// exact in f16); writing rows changes that layer of that block and nothing else.
#[test]
fn kv_layer_blocks_move_as_token_rows() {
    let mut b = backend();
    let s = spec();
    b.init_kv(s).unwrap();
    fill_pool(&mut b);
    let w = s.n_kv_heads * s.head_dim;
    let n = s.block_size * w;
    let (mut k, mut v) = (vec![0f32; n], vec![0f32; n]);
    b.kv_layer_block_to_host(1, 2, &mut k, &mut v).unwrap();
    // fill_pool gave slot `p`'s value `i` in layer `l` the K value (p * w + i + 1000 l) / 4.
    for t in 0..s.block_size {
        for i in 0..w {
            let want = ((2 * s.block_size + t) * w + i + 1000) as f32 * 0.25;
            assert_eq!(k[t * w + i], want, "token {t} value {i}");
            assert_eq!(v[t * w + i], -want);
        }
    }
    let before = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    let rows: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
    let neg: Vec<f32> = rows.iter().map(|x| -x).collect();
    b.kv_layer_block_from_host(2, 3, &rows, &neg).unwrap();
    b.kv_layer_block_to_host(2, 3, &mut k, &mut v).unwrap();
    assert_eq!((k, v), (rows.clone(), neg.clone()));
    let after = blocks_on_host(&mut b, &[0, 1, 2, 3, 4]);
    assert_eq!(after[..3], before[..3]);
    assert_eq!(after[4], before[4]);
    // Layers 0 and 1 of block 3 (the first two thirds of its bytes) are untouched.
    let third = b.kv_block_bytes() / 3;
    assert_eq!(after[3][..2 * third], before[3][..2 * third]);
    assert_ne!(after[3][2 * third..], before[3][2 * third..]);
    // Bad layers, blocks and row lengths are errors.
    assert!(b.kv_layer_block_from_host(3, 0, &rows, &neg).is_err());
    assert!(b.kv_layer_block_from_host(0, 5, &rows, &neg).is_err());
    assert!(b.kv_layer_block_from_host(0, 0, &rows[1..], &neg).is_err());
    let mut short = vec![0f32; n - 1];
    assert!(b
        .kv_layer_block_to_host(0, 0, &mut short, &mut vec![0f32; n])
        .is_err());
}

#[test]
fn kv_ops_need_a_pool_and_memory_info_reads_the_host() {
    let mut b = backend();
    assert_eq!(b.kv_block_bytes(), 0);
    assert!(b.kv_copy_blocks(&[(0, 1)]).is_err());
    assert!(b.kv_blocks_to_host(&[0], &mut []).is_err());
    let m = b.mem_info().unwrap();
    assert!(m.total > 0 && m.free <= m.total, "{m:?}");
    assert_eq!(b.act_dtype(), DType::F32);
    assert!(b.describe().starts_with("cpu ("));
}

#[test]
fn ops_refuse_views_of_the_wrong_shape_or_dtype() {
    let mut b = backend();
    let x = b.alloc(DType::F32, 64).unwrap();
    let mut out = b.alloc(DType::F32, 64).unwrap();
    let w = CpuBuffer::from_f32(vec![1.0; 8]);
    // rms_norm: rows of 8 need 8 weights and an output of the same shape.
    b.rms_norm(
        View::rows(&x, 4, 8).unwrap(),
        &w,
        1e-5,
        ViewMut::rows(&mut out, 4, 8).unwrap(),
    )
    .unwrap();
    assert!(b
        .rms_norm(
            View::rows(&x, 4, 8).unwrap(),
            &w,
            1e-5,
            ViewMut::rows(&mut out, 5, 8).unwrap(),
        )
        .is_err());
    assert!(b
        .rms_norm(
            View::rows(&x, 8, 4).unwrap(),
            &w,
            1e-5,
            ViewMut::rows(&mut out, 8, 4).unwrap(),
        )
        .is_err());
    // swiglu and add: shapes must agree.
    assert!(b
        .swiglu(
            View::rows(&x, 2, 8).unwrap(),
            View::rows(&x, 2, 4).unwrap(),
            ViewMut::rows(&mut out, 2, 8).unwrap(),
        )
        .is_err());
    assert!(b
        .add(
            ViewMut::rows(&mut out, 2, 8).unwrap(),
            View::rows(&x, 8, 2).unwrap()
        )
        .is_err());
    // An f32 op on an i32 buffer.
    let ids = b.alloc(DType::I32, 64).unwrap();
    assert!(b
        .add(
            ViewMut::rows(&mut out, 2, 8).unwrap(),
            View::rows(&ids, 2, 8).unwrap()
        )
        .is_err());
    // Ops over the step's tokens refuse a view that is not one row per token.
    b.begin_step(&npu_backend::StepInputs {
        tokens: vec![1, 2],
        ..Default::default()
    })
    .unwrap();
    let table = b
        .load_embedding(npu_backend::HostTensor {
            ty: npu_gguf::GgmlType::F32,
            data: bytemuck::cast_slice(&[0.5f32; 24]),
            rows: 3,
            cols: 8,
        })
        .unwrap();
    b.embed(&table, ViewMut::rows(&mut out, 2, 8).unwrap())
        .unwrap();
    assert!(b
        .embed(&table, ViewMut::rows(&mut out, 3, 8).unwrap())
        .is_err());
    // A token beyond the table is an error, not a read outside it.
    b.begin_step(&npu_backend::StepInputs {
        tokens: vec![3],
        ..Default::default()
    })
    .unwrap();
    assert!(b
        .embed(&table, ViewMut::rows(&mut out, 1, 8).unwrap())
        .is_err());
}

/// Q8_0 bytes of a `rows x cols` matrix with varied scales and values.
fn q8_0_matrix(rows: usize, cols: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for r in 0..rows {
        for b in 0..cols / 32 {
            let d = half::f16::from_f32(0.01 + 0.003 * ((r + b) % 7) as f32);
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            out.extend((0..32).map(|i| ((r * 31 + b * 17 + i * 7) % 255) as u8));
        }
    }
    out
}

/// A matmul reads the quantized rows an op left only while they are that op's output: after
/// RMSNorm (which quantizes as it writes) it gives what a fresh backend computes from the same
/// values; once the rows were written again (an upload, another op), or for a different window
/// of them, it quantizes anew and still matches.
#[test]
fn a_matmul_reuses_quantized_rows_only_while_they_are_current() {
    let (rows, cols, n) = (12, 64, 48);
    let bytes = q8_0_matrix(n, cols);
    let tensor = HostTensor {
        ty: GgmlType::Q8_0,
        data: &bytes,
        rows: n,
        cols,
    };
    // The product of `x` rows by the matrix on a backend that has done nothing else.
    let fresh = |x: &[f32], r: usize| -> Vec<f32> {
        let mut b = backend();
        let w = b.load_matrix(&[tensor]).unwrap().unwrap();
        let mut xb = b.alloc(DType::F32, r * cols).unwrap();
        b.upload(HostSlice::F32(x), ViewMut::rows(&mut xb, r, cols).unwrap())
            .unwrap();
        let mut ob = b.alloc(DType::F32, r * n).unwrap();
        b.matmul(
            View::rows(&xb, r, cols).unwrap(),
            &w,
            ViewMut::rows(&mut ob, r, n).unwrap(),
        )
        .unwrap();
        ob.as_f32().unwrap().to_vec()
    };
    let mut b = backend();
    let w = b.load_matrix(&[tensor]).unwrap().unwrap();
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 13 % 29) as f32 - 14.0) * 0.21)
        .collect();
    let norm_w = b
        .load_vector(HostTensor {
            ty: GgmlType::F32,
            data: &vec![1.5f32; cols]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>(),
            rows: 1,
            cols,
        })
        .unwrap();
    let mut xb = b.alloc(DType::F32, rows * cols).unwrap();
    b.upload(
        HostSlice::F32(&x),
        ViewMut::rows(&mut xb, rows, cols).unwrap(),
    )
    .unwrap();
    let mut xn = b.alloc(DType::F32, rows * cols).unwrap();
    let mut out = b.alloc(DType::F32, rows * n).unwrap();
    let norm = |b: &mut CpuBackend, xn: &mut CpuBuffer| {
        b.rms_norm(
            View::rows(&xb, rows, cols).unwrap(),
            &norm_w,
            1e-5,
            ViewMut::rows(xn, rows, cols).unwrap(),
        )
        .unwrap();
    };
    let matmul = |b: &mut CpuBackend, xn: &CpuBuffer, out: &mut CpuBuffer, r: usize| {
        b.matmul(
            View::rows(xn, r, cols).unwrap(),
            &w,
            ViewMut::rows(out, r, n).unwrap(),
        )
        .unwrap();
        out.as_f32().unwrap()[..r * n].to_vec()
    };
    norm(&mut b, &mut xn);
    let normed = xn.as_f32().unwrap().to_vec();
    assert_eq!(matmul(&mut b, &xn, &mut out, rows), fresh(&normed, rows));
    // Again (the same rows, still current), and a window of fewer rows (a different key).
    assert_eq!(matmul(&mut b, &xn, &mut out, rows), fresh(&normed, rows));
    assert_eq!(
        matmul(&mut b, &xn, &mut out, 5),
        fresh(&normed[..5 * cols], 5)
    );
    // The rows rewritten by an upload: the product follows the new values.
    let y: Vec<f32> = x.iter().map(|v| -0.5 * v + 0.25).collect();
    norm(&mut b, &mut xn);
    b.upload(
        HostSlice::F32(&y),
        ViewMut::rows(&mut xn, rows, cols).unwrap(),
    )
    .unwrap();
    assert_eq!(matmul(&mut b, &xn, &mut out, rows), fresh(&y, rows));
    // Rewritten by another op (an add) after the RMSNorm: likewise.
    norm(&mut b, &mut xn);
    b.add(
        ViewMut::rows(&mut xn, rows, cols).unwrap(),
        View::rows(&xb, rows, cols).unwrap(),
    )
    .unwrap();
    let summed = xn.as_f32().unwrap().to_vec();
    assert_ne!(summed, normed);
    assert_eq!(matmul(&mut b, &xn, &mut out, rows), fresh(&summed, rows));
}
